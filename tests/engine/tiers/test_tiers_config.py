"""`Tiers` and the nodes: every bad setting refused naming its field and value; who holds
whose replicas."""

from __future__ import annotations

import pytest

import asynctron
from asynctron import EngineConfig, Tiers
from asynctron.engine.tiers import job_nodes
from asynctron.engine.tiers._config import Nodes
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
])
def test_bad_settings_are_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tiers(**{"local": "/tmp/x", **fields})


def test_the_node_placeholder_names_each_nodes_tier(tmp_path: object) -> None:
    tiers = Tiers(local=f"{tmp_path}/node{{node}}", store="s3://b/run")
    assert tiers.local_root(3) == f"{tmp_path}/node3"
    assert Tiers(local="/nvme/ckpt").local_root(3) == "/nvme/ckpt"


def test_the_engine_refuses_a_non_tiers_setting_and_too_few_threads() -> None:
    with pytest.raises(TypeError, match=r"tiers: expected asynctron\.Tiers or None, found dict"):
        EngineConfig(tiers={"local": "/x"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"num_workers: expected more than 2 x Tiers\.replicas "
                                         r"\(4: .*found 4"):
        EngineConfig(tiers=Tiers(local="/x", replicas=2), num_workers=4)
    with pytest.raises(ValueError, match=r"store_backend: expected with tiers that have a "
                                         r"store"):
        asynctron.Engine(store_backend=asynctron.storage.LocalBackend())


def test_replicas_go_to_the_same_local_rank_on_the_next_nodes() -> None:
    nodes = Nodes(rank=1, world_size=8, ranks_per_node=2)  # 4 nodes of 2
    assert (nodes.node, nodes.num_nodes) == (0, 4)
    assert nodes.holders(1, 2) == [3, 5]
    assert nodes.sources(1, 2) == [7, 5]
    assert nodes.holders(7, 1) == [1]  # wraps around
    for rank in range(8):  # each rank keeps exactly the replicas whose holder it is
        for holder in nodes.holders(rank, 3):
            assert rank in nodes.sources(holder, 3)
            assert nodes.node_of(holder) != nodes.node_of(rank)


def test_nodes_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCTRON_RANKS_PER_NODE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    tiers = Tiers(local="/x/{node}", replicas=1)
    assert job_nodes(tiers, 5, 8) == Nodes(5, 8, 4)
    monkeypatch.setenv("ASYNCTRON_RANKS_PER_NODE", "2")  # the override wins
    assert job_nodes(tiers, 5, 8) == Nodes(5, 8, 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("ASYNCTRON_RANKS_PER_NODE")
    assert job_nodes(Tiers(local="/x", replicas=0), 5, 8).num_nodes == 1  # one node


@pytest.mark.parametrize(("env", "world", "tiers", "message"), [
    ("3", 8, Tiers(local="/x/{node}"), r"ranks per node: expected a divisor of the world size "
                                      r"8, found 3"),
    ("4", 8, Tiers(local="/x/{node}", replicas=2), r"Tiers\.replicas: expected at most 1 \(the "
                                                   r"other nodes of 2\), found 2"),
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


def test_names_on_the_tiers_round_trip() -> None:
    assert shard_name(100, 3) == "step_00000100.rank_00003"
    assert parse_shard(shard_name(123456789012, 70000)) == (123456789012, 70000)
    assert parse_step(step_name(7)) == 7
    for name in ("step_1", "step_1.rank_", "latest", ".step_1.rank_2.tmp-x", "step_-1.rank_0"):
        assert parse_shard(name) is None
    assert parse_step("step_00000001.rank_00000") is None
