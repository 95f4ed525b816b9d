"""The restart ladder's decisions, shared by the agent's and the master's failure policies."""

from __future__ import annotations

from enum import Enum


class FailureAction(Enum):
    """What a controller does about a failure (the restart ladder, cheapest first)."""

    RECOVER_IN_PROCESS = "recover_in_process"
    """Replace only the failed worker; the others leave the failed step in their processes and
    join the re-formed world (a script wrapped in `dlrover.trainer.torch.inprocess.Wrapper`)."""
    RESTART_PROCESSES = "restart_processes"
    """Stop this node's workers, re-form the world, start them again on the same node."""
    RELAUNCH_NODE = "relaunch_node"
    """Drop the node; the engine launches a replacement which joins the job."""
    RESTART_JOB = "restart_job"
    """Restart every node's workers from scratch (a controller's last resort before FAIL)."""
    FAIL = "fail"
    """Stop the job and report the root cause; exit non-zero."""


NO_ACTION = "none"
"""The action of a failure record that asks for nothing: a straggler kept for lack of relaunches,
or a node whose ranks wait in a collective for another node's hung rank (what they wait in names
that rank); never a round's root cause."""
