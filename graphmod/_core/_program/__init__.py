"""The program: init (abstract), train and infer, derive, graph, the program-wide manager
chain, the checks of compile's arguments and managers, its record and its variables by role,
input transformations. ``graphmod.compile`` itself, which builds a program's parts with these
checks, is the public ``graphmod._train._program``'s (its docstring says why).
"""
