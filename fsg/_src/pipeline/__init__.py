"""Pipeline parallelism: the ``pp`` mesh axis (docs/parallelism.md)."""
