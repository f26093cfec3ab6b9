"""Flags of `epd serve --role llm|prefill|decode` and the configs built from them
(`--lease-seconds` only for the prefill role)."""

from __future__ import annotations

from typing import Any

from epd.netutil import advertised_host, parse_bytes, public_url


def add_arguments(parser, role: str = "llm") -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the `model` clients must send (default: the model dir's name)")
    parser.add_argument("--vision", choices=("local", "none"), default="none",
                        help="local: run the vision tower in this process (colocated mode)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default="256MiB",
                        help="KV cache budget when --num-blocks is not given (e.g. 256MiB)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--allowed-local-media-path", default=None)
    parser.add_argument("--allowed-media-domains", nargs="*", default=None)
    parser.add_argument("--limit-images-per-request", type=int, default=8)
    parser.add_argument("--proxy-url", default=None, help="register with this epd proxy")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        default="auto")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    parser.add_argument("--seed", type=int, default=0)
    epd = parser.add_argument_group("EPD migration (requests with encoder_result)")
    epd.add_argument("--transfer", choices=("auto", "tcp", "rdma", "nvlink"), default="auto",
                     help="data plane for pulling image features from encoders")
    epd.add_argument("--mm-block-tokens", type=int, default=16,
                     help="feature rows per block of this engine's feature pool")
    size = epd.add_mutually_exclusive_group()
    size.add_argument("--mm-cache-memory", type=parse_bytes, default="64MiB",
                      help="feature pool size (e.g. 64MiB) when --mm-num-blocks is not given")
    size.add_argument("--mm-num-blocks", type=int, default=None, help="feature pool blocks")
    epd.add_argument("--migration-timeout", type=float, default=30.0,
                     help="seconds an EPD migration (handshake + reads) may take")
    epd.add_argument("--engine-id", default=None,
                     help="transfer id presented to peers (default: random)")
    if role == "prefill":
        pd = parser.add_argument_group("PD disaggregation (prefill role)")
        pd.add_argument("--lease-seconds", type=float, default=60.0,
                        help="how long handed-over KV blocks stay held without the decode "
                             "engine's ack")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))


def engine_config_from_args(args) -> Any:
    from epd.llm.config import EngineConfig

    return EngineConfig(
        model_dir=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        vision=args.vision,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        mm_block_tokens=args.mm_block_tokens,
        mm_num_blocks=args.mm_num_blocks,
        mm_cache_memory_bytes=args.mm_cache_memory,
        transfer=args.transfer,
        transfer_host=advertised_host(args.host),
        migration_timeout_s=args.migration_timeout,
        engine_id=args.engine_id,
        role=getattr(args, "role", "llm"),
        lease_seconds=getattr(args, "lease_seconds", 60.0),
        public_url=public_url(args.host, args.port),
    )


def media_config_from_args(args) -> Any:
    from epd.encoder.media import MediaConfig

    domains = tuple(args.allowed_media_domains) if args.allowed_media_domains else None
    return MediaConfig(
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=domains,
        limit_images_per_request=args.limit_images_per_request,
    )
