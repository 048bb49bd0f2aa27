"""The decoder-only transformer and its from-scratch attention.

May import: safeio.
"""
