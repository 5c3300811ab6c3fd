"""engines/frontend"""
