"""engines/kv"""
