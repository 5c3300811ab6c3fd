"""engines/process"""
