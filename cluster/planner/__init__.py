"""The SLO planner: profile one worker, simulate a cluster on a workload, plan pool sizes and limits.

`profile` (the JSON profile) -> `simulator` (discrete events, the router's and scheduler's rules)
-> `plan` (the search). `measure` fills a profile from a real engine (torch); every other module is
standard library (plus rich and yaml at the edges), so plans run in seconds without torch or ray.
"""
