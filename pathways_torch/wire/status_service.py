"""The name of the controller's gRPC status service, shared by its server (`controller.status`) and its reader
(``pathways-status``, `pathways_torch.launch.health`), which may not import each other (DESIGN §5)."""

__all__ = ["STATUS_SERVICE", "STATUS_GET", "STATUS_METHOD", "STATUS_ADMIN", "ADMIN_METHOD", "ADMIN_TOKEN_METADATA"]

STATUS_SERVICE = "pathways.Status"                       # the service, as a generic gRPC handler registers it
STATUS_GET = "Get"                                       # its one method (messages in pathways.proto)
STATUS_METHOD = f"/{STATUS_SERVICE}/{STATUS_GET}"        # the full path a client calls
STATUS_ADMIN = "Admin"                                   # a standalone controller's operator requests
ADMIN_METHOD = f"/{STATUS_SERVICE}/{STATUS_ADMIN}"
ADMIN_TOKEN_METADATA = "pathways-admin-token"            # the gRPC metadata key an Admin request carries the token in
