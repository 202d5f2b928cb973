"""The single controller: spawns replica groups on Monarch, decides every generation, replaces the dead.

It lives in the user's process and knows nothing about any training framework. Its whole vocabulary is
replicas (one Monarch ProcMesh each), generations (numbered plans in a TCPStore it hosts) and policies
(min/max replicas, restarts, crash loops). Deaths reach it three ways, whichever is first: a pidfd that
becomes readable when a local worker process exits (milliseconds), Monarch supervision (the replaced
`unhandled_fault_hook`, ~0.5 s), and a failed call to the replica's actor. An exception in a replica's
training code reaches it as the report its proc writes to the store (`Raised`): that replica is replaced as a
dead one is, unless another replica raised the same at the same step. A member that reports a stalled reduction
gets its peers' phases checked, and the one stuck outside the reduction is killed.

One job a module:

* `run`: `ElasticController`, the run loop and its state: starts the run, takes the reports and hands each to the
  module whose job it is, and decides when the run is over.
* `bootstrap`: the run's store, events file and stale checkpoints; which checkpoint it resumes.
* `spawning`: where a replica is placed and how it is launched, its env, its call to train.
* `deaths`: deaths, hosts lost and joined, replacements and admission, and when to probe for a hang.
* `drains`: signals with notice, to a replica, a host or this process: who leaves when, or a stop.
* `triage`: whether what a replica's code raised is the replica's failure or the code's own bug (pure).
* `hangs`: who a probe's answers show hung, and why (pure).
* `generations`: publishing the next generation, whether training ended, and a give-up's checkpoint.
* `policies`: who trains next, whether to respawn, when to stop (pure).
* `faults`: Monarch's fault hook, routed to the running controller.
* `replica`: the records the modules share (a replica's, a finished run's).
"""

from __future__ import annotations

from monarch_plugin.controller.replica import RunResult
from monarch_plugin.controller.run import ElasticController

__all__ = ["ElasticController", "RunResult"]
