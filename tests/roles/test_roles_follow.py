"""The run's policy as a worker or validator follows it (``roles/common/follow.TrainerPolicy``), over real
nodes on 127.0.0.1: announcements by gossipsub, blobs over HTTP. Only the run's trainer's announcements count
(a peer announcing a policy of its own is refused at the gossip validator and blamed); each version reaches
the role once, in order; a follower started again begins from the version it holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from intellect_node.blobs.service import BlobService
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.policy import announcement_validator
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.fetch import HintedFetcher
from intellect_node.roles.common.follow import TrainerPolicy
from intellect_node.roles.common.policy import PolicyPublisher
from intellect_node.roles.common.seams import RoleTasks, Runtime
from intellect_node.roles.common.services import blob_service
from tests.support.delta import policy_versions
from tests.support.swarm import line, run, runtime_nodes
from tests.support.wait import wait_until

torch.set_num_threads(1)
RUN = "follow"
POLICY = topic(RUN, "policy")


def _blobs(rt: Any) -> BlobService:
    return blob_service(rt)


class _RunNamesTrainer:
    """A node whose run config names ``trainer`` as the run's trainer (``runtime_nodes`` gives every node
    one config, made before any key exists); everything else is the real runtime."""

    def __init__(self, rt: Any, trainer: str) -> None:
        self._rt = rt
        run_cfg = rt.config.run.model_copy(update={"trainer_peer_id": trainer})
        self.config = rt.config.model_copy(update={"run": run_cfg})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)


class _Role:
    """What a role hands the follower: its tasks, its fetcher, and a record of what it was given."""

    def __init__(self, node: Runtime, directory: Path) -> None:
        self.tasks = RoleTasks(node, "worker")
        self.fetcher = HintedFetcher(_blobs(node), node.swarm)
        self.got: list[tuple[int, str]] = []
        self.heard: list[int] = []
        self.closed = False
        self.policy = TrainerPolicy(node, self.fetcher, directory, self.tasks, self._load,
                                    on_announcement=lambda ann: self.heard.append(ann.version))

    async def _load(self, version: int, ckpt: PolicyWeights) -> None:
        self.got.append((version, ckpt.content_hash))

    async def close(self) -> None:
        await self.tasks.close()
        if not self.closed:
            self.fetcher.close()
            self.closed = True


def test_a_role_follows_its_trainer_only_and_restarts_from_what_it_holds(tmp_path: Path) -> None:
    versions = policy_versions(torch.bfloat16, 3)
    hashes = [v.content_hash for v in versions]

    async def main() -> None:
        factory = [lambda rt: BlobService.from_swarm(rt.swarm, rt.data_dir, board=rt.board)]
        # trainer(0) - follower(1) - mallory(2)
        async with runtime_nodes(tmp_path, 3, line(3), run_id=RUN, services=factory) as rts:
            trainer, mallory = rts[0].swarm, rts[2].swarm
            node = cast(Runtime, _RunNamesTrainer(rts[1], trainer.peer_id))
            policy_dir = tmp_path / "follower-policy"
            role = _Role(node, policy_dir)
            roles = [role]
            await role.policy.start()
            assert role.got == [] and role.policy.version is None
            for sw in (trainer, mallory):
                sw.subscribe(POLICY, announcement_validator(RUN, sw.peer_id), lambda m, o: None)
            await wait_until(lambda: len(rts[1].swarm.mesh_peers(POLICY)) == 2 and trainer.mesh_peers(POLICY)
                             and mallory.mesh_peers(POLICY), 30, what="policy meshes")
            pub = PolicyPublisher(tmp_path / "pub", _blobs(rts[0]), trainer.key, RUN, full_every=8)
            forger = PolicyPublisher(tmp_path / "forged", _blobs(rts[2]), mallory.key, RUN)
            try:
                # Mallory announces a far newer version of its own: refused before the role sees it.
                _, forged = await forger.publish(99, versions[2])
                await mallory.publish(POLICY, forged)
                await wait_until(lambda: rts[1].swarm.peerbook.rejections(mallory.peer_id)[0] >= 1, 30,
                                 what="the forged announcement refused")
                for v in range(3):
                    _, raw = await pub.publish(v, versions[v])
                    await trainer.publish(POLICY, raw)
                    await wait_until(lambda: role.got and role.got[-1][0] == v, 60, what=f"v{v} loaded")
                assert role.got == [(v, hashes[v]) for v in range(3)]
                assert 99 not in role.heard and set(role.heard) == {0, 1, 2}
                assert role.policy.version == 2 and node.board.snapshot().policy.local == 2
                repeats = role.heard.count(2)
                await trainer.publish(POLICY, raw)  # the trainer's repeat of v2: heard, nothing to load
                await wait_until(lambda: role.heard.count(2) > repeats, 30, what="the repeat heard")
                assert role.got == [(v, hashes[v]) for v in range(3)]
                await role.close()

                # Started again: the version held on disk goes to the role before any announcement.
                roles.append(again := _Role(node, policy_dir))
                await again.policy.start()
                assert again.got == [(2, hashes[2])] and again.policy.version == 2
            finally:
                for r in roles:
                    await r.close()

    run(main(), 240)


def test_followers_of_a_large_blob_announce_it_and_look_past_the_trainer(tmp_path: Path) -> None:
    """A role's fetch asks the hinted holder (the trainer) first, without a DHT lookup. A blob of
    ANNOUNCE_MIN_CHUNKS chunks or more is announced by each follower once its manifest is in, and a later
    lookup of the same fetch adds what the DHT knows: the followers find each other. A small blob (a
    delta, a rollout batch) is not announced."""
    import asyncio
    import os

    from intellect_node.blobs.fetch import MIN_BUDGET_CHUNK
    from intellect_node.roles.common.fetch import ANNOUNCE_MIN_CHUNKS

    big, small = tmp_path / "ckpt.bin", tmp_path / "delta.bin"
    # the smallest chunks a role's fetch accepts for a blob of several chunks (the fetch budget)
    big.write_bytes(os.urandom(MIN_BUDGET_CHUNK * (ANNOUNCE_MIN_CHUNKS + 2)))
    small.write_bytes(os.urandom(1000))

    async def main() -> None:
        factory = [lambda rt: BlobService.from_swarm(rt.swarm, rt.data_dir, board=rt.board)]
        async with runtime_nodes(tmp_path, 3, line(3), run_id=RUN, services=factory) as rts:
            trainer = rts[0].swarm.peer_id
            await wait_until(lambda: all(rt.swarm.peerbook.http_url(trainer) for rt in rts[1:]), 30,
                             what="the trainer's URL heard")
            big_cid, _ = await _blobs(rts[0]).put_file(big, chunk_size=MIN_BUDGET_CHUNK)
            small_cid, _ = await _blobs(rts[0]).put_file(small)
            one, two = (HintedFetcher(_blobs(rt), rt.swarm) for rt in rts[1:])
            lookups: list[str] = []
            real = rts[1].swarm.find_providers

            async def counted(cid: str, **kw: Any) -> Any:
                lookups.append(cid)
                return await real(cid, **kw)

            rts[1].swarm.find_providers = counted
            try:
                for cid in (big_cid, small_cid):
                    await one.fetch(cid, holders=[trainer], max_size=1 << 24, timeout=60)
                assert lookups == []  # the hint served both: no DHT lookup
                assert big_cid in _blobs(rts[1])._provided and small_cid not in _blobs(rts[1])._provided
                # Node 1's record reaches the DHT; node 2's second lookup of the blob finds it.
                two._hints[big_cid] = [trainer]
                first = await two._find(big_cid)
                assert [p.peer_id for p in first] == [trainer]
                found: list[str] = []

                async def second_lookup_finds_node_1() -> bool:
                    two._looked.add(big_cid)
                    found[:] = [p.peer_id for p in await two._find(big_cid)]
                    return rts[1].swarm.peer_id in found

                for _ in range(60):  # bounded: DHT records of a moment ago may take a few rounds
                    if await second_lookup_finds_node_1():
                        break
                    await asyncio.sleep(0.25)
                assert found[0] == trainer and rts[1].swarm.peer_id in found
            finally:
                one.close()
                two.close()

    run(main(), 240)
