"""The shared view: what several routerd processes (replicas on several hosts, workers of one) share
through Redis — the fleet state the controlling process publishes and the others follow
(:mod:`.fleet_state`), replica counts set at run time (:mod:`.replicas`), admin calls carried to the
controller (:mod:`.admin_relay`). Every key comes from :mod:`routerd.keys`; every loop is its caller's.
"""
