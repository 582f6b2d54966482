"""Throwaway experiment (issue 39): the most urgent lane served by a second Worker
on its own thread and event loop, in the same process; the other lanes by the
main one. Enabled by TWO_LANE=1; SWITCH_MS sets sys.setswitchinterval."""

import os
import sys

if os.environ.get("TWO_LANE"):
    import asyncio
    import dataclasses
    import threading

    if os.environ.get("SWITCH_MS"):
        sys.setswitchinterval(float(os.environ["SWITCH_MS"]) / 1000)

    import worker.app.service as svc

    original = svc.serve

    async def _urgent(settings):
        from worker.app.worker import Worker

        w = Worker(settings)
        await w.start()
        await w.wait()

    async def serve(settings):
        lanes = settings.kafka.ranked_lanes
        if len(lanes) < 2:
            return await original(settings)
        top, rest = lanes[0], lanes[1:]
        rest_topics = tuple(t for lane in rest for t in lane.topics)
        k = settings.kafka
        urgent = dataclasses.replace(
            settings,
            kafka=dataclasses.replace(k, input_topics=top.topics, lanes=()),
            metrics=dataclasses.replace(settings.metrics, port=0),
        )
        bulk = dataclasses.replace(
            settings,
            kafka=dataclasses.replace(
                k,
                input_topics=rest_topics,
                lanes=tuple(dataclasses.replace(lane) for lane in rest) if len(rest) > 1 else (),
            ),
        )
        t = threading.Thread(
            target=lambda: asyncio.run(_urgent(urgent)), daemon=True, name="urgent"
        )
        t.start()
        print("two-lane: urgent thread started", top.topics, file=sys.stderr, flush=True)
        return await original(bulk)

    svc.serve = serve
