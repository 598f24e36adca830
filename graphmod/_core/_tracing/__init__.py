"""One trace of a program: the context stacks, the frame, the chain of managers around each call,
the call's view for hooks, the parameter read and its rewrite (variables), the rewrite trace and
what a trace collects.
"""
