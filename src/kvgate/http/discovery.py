from kvgate.http.openai import (  # noqa: F401  # moved: re-export until merge
    GATEWAY_INFO_PATH,
    EngineInfo,
    Getter,
    Unreachable,
    discover,
    is_vllm_server_info,
    parse_cache_config,
    parse_gateway_info,
    parse_server_info,
)
