# tests/test_limits_request.py - request and batch size limits on a real 4-replica cluster
# (docs/wire.md "Size limits"): a request just under the limit is ordered; one over it, even
# one that fits a frame alone, is refused at intake by every replica with a REJECTED REPLY
# the client turns into RequestTooLarge; the view never changes and honest requests keep
# completing. Before the limits, a request near 16 MiB made the primary build a batch it
# could not send, and the cluster changed view again and again.
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from cluster import running_cluster

from zz import wire
from zz.client import Client, ClientParams, RequestTooLarge

MIB = 1 << 20


def test_over_limit_request_is_refused_and_the_view_stays(tmp_path: Path) -> None:
    with running_cluster(tmp_path, clients=4) as c:
        params = ClientParams.from_config(c.config, c.service.id, 0)
        limit = params.max_request
        assert limit == 1 * MIB  # the default; 4 echo clients do not lower it
        # A client that does not know the limit: the replicas must refuse for it.
        blind = Client(dataclasses.replace(params, max_request=None))

        async def run() -> None:
            async with blind, c.client(1) as honest, c.client(2) as knowing:
                under = b"u" * (limit - 2048)
                assert await blind.invoke(under, timeout=20) == under
                # 8 bytes under the frame limit with its header and 4 MACs (16 + 13 + 2 + 4 * 36
                # bytes): alone it fits a frame, in a PRE-PREPARE it did not.
                huge = b"h" * (wire.MAX_MSG - 175 - 8)
                with pytest.raises(RequestTooLarge) as e:
                    await blind.invoke(huge, timeout=20)
                assert e.value.limit == limit and e.value.size > limit
                assert blind.stats["rejected_replies"] >= c.g + 1
                # Just over the limit, while honest requests run for longer than the view
                # timeout (1 s): none of them may fail and no view change may start.
                over = b"o" * (limit + 1)
                task = asyncio.ensure_future(blind.invoke(over, timeout=20))
                loop = asyncio.get_running_loop()
                t_end = loop.time() + 3.0
                done = 0
                while loop.time() < t_end:
                    op = f"honest {done}".encode()
                    assert await honest.invoke(op, timeout=10) == op
                    done += 1
                with pytest.raises(RequestTooLarge):
                    await task
                assert done > 0
                # A client that knows the limit refuses before sending anything.
                with pytest.raises(RequestTooLarge):
                    await knowing.invoke(over, timeout=5)
                assert knowing.stats["too_large_refused"] == 1
                assert knowing.stats["requests"] == 0

        asyncio.run(run())
        refused = 0
        for r in range(c.n):
            st = c.stats(r)
            assert st["view"] == 0 and st["view_changes"] == 0, c.summary()
            refused += st["limits"]["requests_too_large"] > 0
            assert st["limits"]["request_limit"] == limit
        assert refused >= 2 * c.g + 1
