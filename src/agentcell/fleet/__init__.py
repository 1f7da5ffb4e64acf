"""Sessions beyond one machine: plans as plain data (:mod:`.plan`), run where agentcell runs as
root. :mod:`.node` runs one plan on the machine it is on (no Ray); :mod:`.cluster` spreads plans over a Ray
cluster (the ``agentcell[ray]`` extra); :mod:`agentcell.k8s` renders a plan as agent-sandbox resources.
The fleet schedules nothing itself: Ray (or Kubernetes) does.
"""
