"""The engine: how `with_hooks` finds a function's residuals and stores each one.

See README.md in this folder for its data flow and where to make a change.
"""
