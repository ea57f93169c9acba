"""ckptlib.cli"""
