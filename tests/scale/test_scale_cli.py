"""`tokenmill serve`'s Ray Serve options: parsing, their contradictions, and the deployments
they build (fixed or autoscaled replicas, resources, router), without starting Ray."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("ray.serve")

from tokenmill.config import EngineConfig, ModelConfig, ServerConfig  # noqa: E402
from tokenmill.engine.args import LoRAModule  # noqa: E402
from tokenmill.serve_ray.app import ScaleConfig, assign_adapters, build_application  # noqa: E402
from tokenmill.serve_ray.cli import (  # noqa: E402
    add_ray_serve_args,
    scale_config_from_args,
    wants_ray,
)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_ray_serve_args(p)
    return p.parse_args(list(argv))


def _deployments(app) -> list:  # the replica deployments the ingress is bound to
    return [bound._bound_deployment for bound in app._bound_deployment.init_args[0]]


def _replicas(app):  # the first model's
    return _deployments(app)[0]


def test_no_replica_option_is_one_plain_server() -> None:
    assert not wants_ray(_args())
    assert wants_ray(_args("--replicas", "2"))
    assert wants_ray(_args("--max-replicas", "3"))


def test_fixed_replicas_with_resources_and_router() -> None:
    scale = scale_config_from_args(_args("--replicas", "3", "--router", "round_robin",
                                         "--replica-cpus", "2", "--replica-gpus", "1"))
    deployment = _replicas(build_application([(None, EngineConfig())], ServerConfig(), scale))
    assert deployment.num_replicas == 3
    assert deployment.ray_actor_options["num_cpus"] == 2
    assert deployment.ray_actor_options["num_gpus"] == 1
    router = deployment._deployment_config.request_router_config
    assert router.request_router_class.endswith("RoundRobinRouter")


def test_autoscaling_on_queue_length() -> None:
    scale = scale_config_from_args(_args("--min-replicas", "1", "--max-replicas", "4",
                                         "--target-ongoing-requests", "2"))
    assert scale.replicas is None
    deployment = _replicas(build_application([(None, EngineConfig())], ServerConfig(), scale))
    autoscaling = deployment._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 4)
    assert autoscaling.target_ongoing_requests == 2


@pytest.mark.parametrize("argv, message", [
    (("--replicas", "2", "--max-replicas", "3"), "not both"),
    (("--replicas", "0"), "replicas must be at least 1"),
    (("--min-replicas", "3", "--max-replicas", "2"), "min_replicas"),
    (("--max-replicas", "2", "--target-ongoing-requests", "0"), "target_ongoing_requests"),
])
def test_contradictions_name_the_option(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scale_config_from_args(_args(*argv))


def test_unknown_router_is_refused() -> None:
    with pytest.raises(ValueError, match="router"):
        ScaleConfig(router="random")


def test_serve_command_refuses_a_contradiction_before_starting_ray() -> None:
    """`tokenmill serve --replicas` goes to Ray Serve; a contradiction is a usage error that
    names the options, before any cluster or model starts."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tokenmill", "serve", "--replicas", "2",
                           "--max-replicas", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--replicas or --min-replicas/--max-replicas" in done.stderr


def _chat(tmp_path) -> EngineConfig:
    (tmp_path / "chat.gguf").write_bytes(b"GGUF")
    return EngineConfig(model=ModelConfig(model=str(tmp_path / "chat.gguf")))


def test_one_deployment_per_model_with_its_adapters(tmp_path) -> None:
    """Each served model is a deployment of its own, with the replicas, resources and router
    of the options, and the adapters whose base it is."""
    chat = _chat(tmp_path)
    embed = EngineConfig(model=ModelConfig(task="embed"))
    models = [("a", chat), ("b/v2", chat), (None, embed)]
    lora = [LoRAModule("sql", "/l/sql"), LoRAModule("pirate", "/l/p", base_model_name="b/v2")]
    scale = scale_config_from_args(_args("--replicas", "2", "--router", "prefix"))
    app = build_application(models, ServerConfig(), scale, lora)
    deployments = _deployments(app)
    assert [d.name for d in deployments] == ["tokenmill-replica-a", "tokenmill-replica-b_v2",
                                             "tokenmill-replica-2"]
    assert all(d.num_replicas == 2 for d in deployments)
    assert all(d._deployment_config.request_router_config.request_router_class
               .endswith("PrefixAwareRouter") for d in deployments)
    bound = app._bound_deployment.init_args[0]
    assert [b._bound_deployment.init_args[0][0] for b in bound] == ["a", "b/v2", None]
    assert [b._bound_deployment.init_args[2] for b in bound] == [[lora[0]], [lora[1]], []]


def test_adapters_go_to_their_base(tmp_path) -> None:
    chat = _chat(tmp_path)
    embed = EngineConfig(model=ModelConfig(task="embed"))
    models = [(None, embed), (None, chat)]
    # No base named: the first model that generates text; a base named by the file's name.
    assert assign_adapters(models, [LoRAModule("x", "/x"),
                                    LoRAModule("y", "/y", base_model_name="chat")]) == [
        [], [LoRAModule("x", "/x"), LoRAModule("y", "/y", base_model_name="chat")]]
    with pytest.raises(ValueError, match="base_model_name 'nope' is not a served model"):
        assign_adapters([("a", chat), ("b", chat)], [LoRAModule("z", "/z", "nope")])


def test_models_dir_gets_replicas_that_load_on_demand(tmp_path) -> None:
    engine_args = argparse.Namespace(max_model_len=256)
    server = ServerConfig(models_dir=str(tmp_path))
    app = build_application([(None, EngineConfig())], server,
                            scale_config_from_args(_args("--replicas", "3")),
                            engine_args=engine_args)
    on_demand = app._bound_deployment.init_kwargs["on_demand"]._bound_deployment
    assert on_demand.name == "tokenmill-replica-models-dir" and on_demand.num_replicas == 3
    assert on_demand.init_args[0] is None
    assert on_demand.init_kwargs["engine_args"] is engine_args
    assert app._bound_deployment.init_kwargs["models_dir"] == str(tmp_path)
    assert build_application([(None, EngineConfig())], ServerConfig(),
                             ScaleConfig())._bound_deployment.init_kwargs["on_demand"] is None


def test_serve_command_refuses_overlapping_kv_event_ports() -> None:
    """With --replicas each replica binds the KV-event ports + its rank: vLLM's usual 5557 /
    5558 would collide for two replicas, refused by name before any cluster starts."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tokenmill", "serve", "--replicas", "2",
                           "--kv-events-endpoint", "tcp://*:5557",
                           "--kv-events-replay-endpoint", "tcp://*:5558"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "overlaps" in done.stderr and "one port per replica" in done.stderr


def test_the_ingress_gets_the_servers_options_and_the_projects_settings() -> None:
    """The ingress answers the admin API and checks project keys: it is bound with the
    server's options (admin key, data folder) and the projects' settings."""
    from tokenmill.tenancy.retention import TenancySettings

    server = ServerConfig(admin_key="adm", allow_runtime_lora_updating=True)
    settings = TenancySettings(usage_retention_days=7)
    app = build_application([(None, EngineConfig())], server, ScaleConfig(), tenancy=settings)
    kwargs = app._bound_deployment.init_kwargs
    assert kwargs["server"] is server and kwargs["tenancy"] is settings
