"""Launching on many hosts: ``pathways-run`` (torchrun's flags), the run's keys, the ``PATHWAYS_*`` variables.

See docs/launch.md.
"""

from .environment import LAUNCH_VARIABLES, LaunchEnvironment
from .keys import make_run_keys
from .service_keys import (CLIENT_PREFIX, ServiceKeyFolders, check_client_names, client_name, client_role,
                           make_service_keys, service_folders)

__all__ = ["LaunchEnvironment", "LAUNCH_VARIABLES", "make_run_keys", "CLIENT_PREFIX", "ServiceKeyFolders",
           "check_client_names", "client_name", "client_role", "make_service_keys", "service_folders"]
