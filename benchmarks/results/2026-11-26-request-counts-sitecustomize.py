import atexit, collections, json, os
from aiokafka import conn as _conn
_counts = collections.Counter()
_send = _conn.AIOKafkaConnection.send
def send(self, request, expect_response=True):
    _counts[type(request).__name__.split("_")[0]] += 1
    return _send(self, request, expect_response)
_conn.AIOKafkaConnection.send = send
@atexit.register
def _dump():
    path = os.environ.get("REQUEST_COUNTS")
    if path:
        with open(f"{path}.{os.getpid()}", "w") as fh:
            json.dump(dict(_counts), fh)
