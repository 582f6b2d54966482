"""Group the event loop's py-spy samples into the issue's buckets (inclusive, first match wins per sample)."""
import sys, json, collections
BUCKETS = [
    ("decode (decode_request)", ["decode_request"]),
    ("intake, rest (JobFactory, model input check, Job)", ["JobFactory.__call__"]),
    ("consume: aiokafka fetch + records", ["AIOKafkaConsumer.getmany", "Fetcher."]),
    ("batching", ["MicroBatcher", "batching.py"]),
    ("inference call from the loop (triage, scatter, run_in_executor)", ["InferenceStage", "triage"]),
    ("encode results (record_for)", ["record_for"]),
    ("send (send_grouped, aiokafka producer)", ["send_grouped", "Sender.", "SendProduceReqHandler", "MessageAccumulator", "AIOKafkaProducer"]),
    ("acknowledge (Writer._acknowledged, ack futures)", ["_acknowledged", "_await_acks"]),
    ("commit", ["Committer", "_do_commit_offsets", "GroupCoordinator.commit"]),
    ("socket reads (responses)", ["_read_ready", "AIOKafkaConnection._read", "readexactly"]),
    ("select / idle in the loop", ["EpollSelector.select"]),
]
def load(p):
    for line in open(p):
        stack, n = line.rstrip().rsplit(" ", 1)
        yield stack.split(";"), int(n)
out = {}
for p in sys.argv[1:]:
    c = collections.Counter(); total = 0
    for s, n in load(p):
        if not any("_run_once" in f for f in s): continue
        total += n
        joined = ";".join(s)
        for name, keys in BUCKETS:
            if any(k in joined for k in keys):
                c[name] += n; break
        else:
            c["other"] += n
    out[p] = {"loop_samples": total, **{k: round(100 * v / total, 1) for k, v in c.items()}}
names = [b for b, _ in BUCKETS] + ["other"]
files = sys.argv[1:]
print("| bucket | " + " | ".join(files) + " |")
for name in names:
    print(f"| {name} | " + " | ".join(str(out[f].get(name, 0.0)) + "%" for f in files) + " |")
print("| loop samples | " + " | ".join(str(out[f]["loop_samples"]) for f in files) + " |")
json.dump(out, open("/tmp/buckets.json", "w"), indent=1)
