"""Selection: the filter language, stored variables named by selectors, placement rules and the
hints for a filter that matched nothing.
"""
