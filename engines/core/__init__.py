"""engines/core"""
