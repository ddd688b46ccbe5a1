"""Launching on many hosts: ``pathways-run`` (torchrun's flags), the run's keys, the ``PATHWAYS_*`` variables.

See docs/launch.md.
"""

from .environment import LAUNCH_VARIABLES, LaunchEnvironment
from .keys import make_run_keys

__all__ = ["LaunchEnvironment", "LAUNCH_VARIABLES", "make_run_keys"]
