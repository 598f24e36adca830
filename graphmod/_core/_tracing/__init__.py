"""One trace of a program: the context stacks, the frame, the chain of managers around each call,
the call's view for hooks, the parameter read (``_parameter_read``: a model variable as a call
reads it, rewritten by the managers' ``rewrite_parameter``), the variables that redirect their
reads and writes to the program, the rewrite trace and what a trace collects.
"""
