"""The program: compile, init (abstract), train and infer, derive, graph, the program-wide manager
chain, the checks of arguments and managers, its record and its variables by role, input
transformations.
"""
