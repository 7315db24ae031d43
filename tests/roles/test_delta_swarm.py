"""End to end over real nodes on 127.0.0.1: the trainer's announcements travel by gossipsub, blobs are
found through the Kademlia DHT and fetched over HTTP, and workers follow every version by delta."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from intellect_node.blobs.service import BlobService
from intellect_node.protocol.policy import announcement_validator
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.policy import ObtainResult, PolicyFollower, PolicyPublisher
from intellect_node.roles.common.services import blob_service
from tests.support.delta import policy_versions
from tests.support.swarm import line, run, runtime_nodes
from tests.support.wait import wait_until

torch.set_num_threads(1)
RUN = "test"


def _blobs(rt: Any) -> BlobService:
    return blob_service(rt)


def test_workers_follow_gossiped_versions_by_delta(tmp_path: Path) -> None:
    versions = policy_versions(torch.bfloat16, 3)
    policy_topic = topic(RUN, "policy")

    async def main() -> None:
        factory = [lambda rt: BlobService.from_swarm(rt.swarm, rt.data_dir, board=rt.board)]
        # trainer(0) - worker(1) - worker(2): worker 2 hears announcements only through worker 1.
        async with runtime_nodes(tmp_path, 3, line(3), run_id=RUN, services=factory) as rts:
            trainer = rts[0].swarm
            pub = PolicyPublisher(tmp_path / "pub", _blobs(rts[0]), trainer.key, RUN, full_every=8)
            got: dict[int, list[ObtainResult]] = {1: [], 2: []}
            tasks = []
            for i in (1, 2):
                fol = PolicyFollower(rts[i].data_dir / "policy", _blobs(rts[i]), run_id=RUN,
                                     trainer=trainer.peer_id, max_checkpoint_bytes=1 << 24,
                                     board=rts[i].board)
                rts[i].swarm.subscribe(policy_topic, announcement_validator(RUN, trainer.peer_id),
                                       lambda ann, origin, fol=fol: fol.offer(ann))

                def record(r: ObtainResult, i: int = i) -> None:
                    got[i].append(r)

                tasks.append(asyncio.create_task(fol.follow(record)))
            trainer.subscribe(policy_topic, announcement_validator(RUN, trainer.peer_id), lambda m, o: None)
            await wait_until(lambda: rts[1].swarm.mesh_peers(policy_topic)
                             and rts[2].swarm.mesh_peers(policy_topic)
                             and trainer.mesh_peers(policy_topic), 20, what="policy meshes")
            try:
                for v in range(3):
                    ann, raw = await pub.publish(v, versions[v])
                    await trainer.publish(policy_topic, raw)
                    await wait_until(lambda: all(got[i] and got[i][-1].version == v for i in (1, 2)), 30,
                                     what=f"both workers at v{v}")
                for i in (1, 2):
                    assert [r.version for r in got[i]] == [0, 1, 2]
                    assert [r.path for r in got[i]] == ["full", "delta", "delta"]
                    assert bytes(got[i][-1].checkpoint.to_bytes()) == bytes(versions[2].to_bytes())
                    assert rts[i].board.snapshot().policy.local == 2
            finally:
                for t in tasks:
                    t.cancel()

    run(main(), 120)
