import asyncio
import sys

import uvloop

asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
print("sitecustomize: uvloop policy", file=sys.stderr)
