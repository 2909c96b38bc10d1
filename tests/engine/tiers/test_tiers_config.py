"""`Tiers` and the nodes: every bad setting refused naming its field and value; who holds
whose replicas."""

from __future__ import annotations

import pytest

import asynctron
from asynctron import EngineConfig, Tiers
from asynctron.engine.tiers._config import Nodes, job_nodes
from asynctron.engine.tiers._layout import parse_shard, parse_step, shard_name, step_name


@pytest.mark.parametrize(("fields", "message"), [
    ({"local": ""}, r"Tiers\.local: expected a non-empty path or URL, found ''"),
    ({"local": 3}, r"Tiers\.local: expected a non-empty path or URL, found 3"),
    ({"local": "/x/{rank}"}, r"Tiers\.local: expected a path whose only placeholder is "
                             r"\{node\}, found \['rank'\]"),
    ({"replicas": -1}, r"Tiers\.replicas: expected an int >= 0, found -1"),
    ({"store_every": 0}, r"Tiers\.store_every: expected an int >= 1, found 0"),
    ({"keep_local": True}, r"Tiers\.keep_local: expected an int >= 1, found True"),
    ({"keep_store": 0}, r"Tiers\.keep_store: expected None or an int >= 1, found 0"),
    ({"store": ""}, r"Tiers\.store: expected a non-empty path or URL, found ''"),
    ({"store": "gs//b/run"}, r"^Tiers\.store: path 'gs//b/run': .* did you mean 'gs://b/run'\?"),
    ({"store": "gcs://b/run"}, r"^Tiers\.store: path 'gcs://b/run': .* did you mean "
                               r"'gs://b/run'\?"),
    ({"store": "hdfs://nn/run"}, r"^Tiers\.store: path 'hdfs://nn/run': .* found the scheme "
                                 r"'hdfs'"),
])
def test_bad_settings_are_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tiers(**{"local": "/tmp/x", **fields})


def test_the_node_placeholder_names_each_nodes_tier(tmp_path: object) -> None:
    tiers = Tiers(local=f"{tmp_path}/node{{node}}", store="s3://b/run")
    assert tiers.local_root(3) == f"{tmp_path}/node3"
    assert Tiers(local="/nvme/ckpt").local_root(3) == "/nvme/ckpt"


def test_the_engine_refuses_a_non_tiers_setting() -> None:
    with pytest.raises(TypeError, match=r"tiers: expected asynctron\.Tiers or None, found dict"):
        EngineConfig(tiers={"local": "/x"})  # type: ignore[arg-type]
    EngineConfig(tiers=Tiers(local="/x", replicas=2), num_workers=1)  # replicas need no thread
    with pytest.raises(ValueError, match=r"store_backend: expected with tiers that have a "
                                         r"store"):
        asynctron.Engine(store_backend=asynctron.storage.LocalBackend())


def test_replicas_go_to_the_same_local_rank_on_the_next_nodes() -> None:
    nodes = Nodes(rank=1, world_size=8, ranks_per_node=2, replicas=2)  # 4 nodes of 2
    assert (nodes.node, nodes.num_nodes) == (0, 4)
    assert nodes.holders(1) == [3, 5]
    assert nodes.sources(1) == [7, 5]
    assert Nodes(rank=7, world_size=8, ranks_per_node=2, replicas=1).holders(7) == [1]  # wraps
    nodes = Nodes(rank=0, world_size=8, ranks_per_node=2, replicas=3)
    for rank in range(8):  # each rank keeps exactly the replicas whose holder it is
        for holder in nodes.holders(rank):
            assert rank in nodes.sources(holder)
            assert nodes.node_of(holder) != nodes.node_of(rank)


def test_nodes_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCTRON_RANKS_PER_NODE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    tiers = Tiers(local="/x/{node}", replicas=1)
    assert job_nodes(tiers, 5, 8) == Nodes(5, 8, 4, replicas=1)
    monkeypatch.setenv("ASYNCTRON_RANKS_PER_NODE", "2")  # the override wins
    assert job_nodes(tiers, 5, 8) == Nodes(5, 8, 2, replicas=1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("ASYNCTRON_RANKS_PER_NODE")
    assert job_nodes(Tiers(local="/x", replicas=0), 5, 8).num_nodes == 1  # one node


@pytest.mark.parametrize(("env", "world", "tiers", "message"), [
    ("3", 8, Tiers(local="/x/{node}"), r"ranks per node: expected a divisor of the world size "
                                      r"8, found 3"),
    ("2", 4, Tiers(local="/x", replicas=0), r"Tiers\.local: ASYNCTRON_RANKS_PER_NODE makes 2 "
                                           r"nodes on one machine, .*without \{node\}"),
    ("x", 4, Tiers(local="/x"), r"ASYNCTRON_RANKS_PER_NODE: expected an int >= 1 \(ranks per "
                               r"node\), found 'x'"),
])
def test_a_world_the_tiers_cannot_serve_is_refused(monkeypatch: pytest.MonkeyPatch, env: str,
                                                   world: int, tiers: Tiers,
                                                   message: str) -> None:
    monkeypatch.setenv("ASYNCTRON_RANKS_PER_NODE", env)
    with pytest.raises(ValueError, match=message):
        job_nodes(tiers, 0, world)


def test_a_job_of_fewer_nodes_keeps_the_replicas_it_can_and_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A job restarted on fewer nodes (or one process) with the same `Tiers` starts."""
    monkeypatch.setenv("ASYNCTRON_RANKS_PER_NODE", "4")
    assert job_nodes(Tiers(local="/x/{node}", replicas=2), 0, 8).replicas == 1
    assert "Tiers.replicas=2, but the job has 2 nodes: keeping 1 replica" in caplog.text
    monkeypatch.delenv("ASYNCTRON_RANKS_PER_NODE")
    assert job_nodes(Tiers(local="/x"), 0, 1).replicas == 0


def test_names_on_the_tiers_round_trip() -> None:
    assert shard_name(100, 3, 4) == "step_00000100.rank_00003.of_00004"
    assert parse_shard(shard_name(123456789012, 70000, 70001)) == (123456789012, 70000, 70001)
    assert parse_step(step_name(7)) == 7
    for name in ("step_1", "step_1.rank_1", "latest", ".step_1.rank_2.of_3.tmp-x",
                 "step_-1.rank_0.of_1", "step_00000001.rank_00004.of_00004"):
        assert parse_shard(name) is None
    assert parse_step("step_00000001.rank_00000.of_00001") is None
