"""routerd's built-in plugins, registered through the same entry points a third party would use.

``routerd_builtin.policies`` holds the routing policies, ``routerd_builtin.launchers`` the engine
launchers; each is imported on demand by entry point, so nothing is re-exported here.
"""
