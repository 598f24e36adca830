"""The model's variables: the layout (identities, paths, roles, aliases), manager-owned variables
and their layout, roles as a tree.
"""
