"""The local stand-in for a cluster: executor processes on this machine (`cluster`), and the shaped link
between local islands (`link`: a relay, rate-limited by the kernel inside a network namespace, `netns`)."""

__all__ = ["cluster", "link", "netns"]
