from kvgate.gateway.pool import PoolNotFound, pool_from_metrics, pool_from_server_info  # noqa: F401  # moved: re-export until merge
