"""What programs and variables look like: tables in terminals and notebooks.
"""
