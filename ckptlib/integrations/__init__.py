"""ckptlib.integrations"""
