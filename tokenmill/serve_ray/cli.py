"""`tokenmill serve`'s options for Ray Serve (--replicas, --router, ...) and the command that
runs when they are given. No Ray import until then: `tokenmill serve --help` stays light."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from tokenmill.serve_ray import ROUTERS

logger = logging.getLogger(__name__)


class StoppedWhileDeploying(Exception):
    """SIGTERM / SIGINT came before the application was running."""


def _app_running() -> bool:
    """Whether Ray Serve says the application is running (its replicas up), so that a stop
    should drain it rather than abandon the deploy."""
    from ray import serve

    try:
        app = serve.status().applications.get("tokenmill")
    except Exception:  # the controller may be gone already: treat as not running
        return False
    return app is not None and str(app.status).endswith("RUNNING")


def add_ray_serve_args(p: argparse.ArgumentParser) -> None:
    """The "scaling out (Ray Serve)" group of `tokenmill serve`."""
    g = p.add_argument_group("scaling out (Ray Serve; pip install tokenmill[ray])")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve on Ray Serve with N replicas of the engines behind one ingress "
                   "(the same HTTP API, each answer naming its replica in x-tokenmill-replica)")
    g.add_argument("--min-replicas", type=int, default=None, metavar="N",
                   help="autoscale on queue length between --min-replicas and --max-replicas "
                   "(instead of --replicas)")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="autoscaling's upper bound (default: --min-replicas)")
    g.add_argument("--target-ongoing-requests", type=float, default=4.0, metavar="N",
                   help="autoscaling: requests in flight or queued per replica to aim for "
                   "(default: %(default)s)")
    g.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="join a running Ray cluster (`ray start --head` prints it; 'auto': the "
                   "one on this machine); default: start a local one")
    g.add_argument("--router", choices=ROUTERS, default="prefix",
                   help="prefix: the replica that already holds the prompt's prefix in its KV "
                   "cache, unless the load is unbalanced; pow2: the less loaded of two; "
                   "round_robin: in turn (default: %(default)s)")
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="N",
                   help="CPUs Ray reserves for each replica (default: %(default)s)")
    g.add_argument("--replica-gpus", type=float, default=0.0, metavar="N",
                   help="GPUs Ray reserves for each replica (default: %(default)s)")


def wants_ray(args: argparse.Namespace) -> bool:
    """Whether `tokenmill serve` runs on Ray Serve (any replica option given)."""
    return any(getattr(args, name, None) is not None
               for name in ("replicas", "min_replicas", "max_replicas"))


def scale_config_from_args(args: argparse.Namespace):  # -> ScaleConfig
    """The ScaleConfig of the options; ValueError for a contradiction."""
    from tokenmill.serve_ray.app import ScaleConfig

    autoscale = args.min_replicas is not None or args.max_replicas is not None
    if autoscale and args.replicas is not None:
        raise ValueError("give --replicas or --min-replicas/--max-replicas, not both")
    if autoscale:
        low = args.min_replicas if args.min_replicas is not None else 1
        high = args.max_replicas if args.max_replicas is not None else max(low, 1)
        return ScaleConfig(replicas=None, min_replicas=low, max_replicas=high,
                           target_ongoing_requests=args.target_ongoing_requests,
                           router=args.router, replica_cpus=args.replica_cpus,
                           replica_gpus=args.replica_gpus)
    return ScaleConfig(replicas=args.replicas, router=args.router,
                       replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus)


def run_ray_serve(args: argparse.Namespace) -> int:
    """Serve ``args``'s models on Ray Serve until SIGTERM / SIGINT (then the replicas drain
    for up to --drain-timeout seconds)."""
    import ray
    from ray import serve

    from tokenmill.engine.args import parse_lora_module
    from tokenmill.serve_ray.app import build_application, generates
    from tokenmill.serve_ray.kv_endpoints import port_ranges
    from tokenmill.server.lora_adapters import check_lora_options
    from tokenmill.server.model_registry import served_models
    from tokenmill.server.serve_cli import merge_model_args, server_config_from_args
    from tokenmill.tenancy.retention import TenancySettings

    merge_model_args(args)
    server = server_config_from_args(args)
    scale = scale_config_from_args(args)
    models = served_models(args)
    # Each replica binds its KV-event endpoints' ports + its rank (kv_endpoints.py).
    port_ranges([m for m in models if generates(m[1])],
                scale.replicas if scale.replicas is not None else scale.max_replicas)
    lora_modules = [parse_lora_module(v) for v in args.lora_modules]
    check_lora_options([c for _, c in models], lora_modules,
                       server.allow_runtime_lora_updating)
    # What replicas that load --models-dir's models on demand need of the command line.
    engine_args = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                        if not callable(v)})
    tenancy = TenancySettings(usage_retention_days=args.usage_retention_days)
    application = build_application(models, server, scale, lora_modules, engine_args, tenancy)
    ray.init(address=args.ray_address, ignore_reinit_error=True)
    serve.start(http_options={"host": server.host, "port": server.port})
    stop, serving = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()
        if not serving.is_set() and not _app_running():
            # serve.run waits for replicas that may never start (no resources for them). An
            # application already running (serve.run about to return, requests in flight)
            # drains instead, as after serve.run.
            raise StoppedWhileDeploying

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        serve.run(application, name="tokenmill", route_prefix="/")
        serving.set()
        logger.info("serving on Ray Serve at http://%s:%d/v1 (%s, router %s)", server.host,
                    server.port, f"{scale.replicas} replicas" if scale.replicas else
                    f"{scale.min_replicas}-{scale.max_replicas} replicas", scale.router)
        stop.wait()
        logger.info("draining: up to %.0f s for the requests in flight", server.drain_timeout)
        ingress = serve.get_app_handle("tokenmill")
        left = ingress.drain.remote(server.drain_timeout).result(
            timeout_s=server.drain_timeout + 30)
        if left:
            logger.warning("drain timeout: %d requests still in flight are cut off", left)
    except StoppedWhileDeploying:
        logger.warning("stopped before every replica was up")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
