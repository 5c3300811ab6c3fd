import glob, json, statistics as st, sys
d = sys.argv[1]
rows = [json.loads(l) for f in glob.glob(d + "/*.jsonl") for l in open(f)]
fe = {r["rid"]: r for r in rows if r.get("who") == "frontend" and "rid" in r}
rt = [r for r in rows if r.get("who") == "router" and "rid" in r]
def show(name, xs):
    xs = sorted(x * 1e3 for x in xs)
    if xs: print(f"{name:28} n={len(xs):5} p50={xs[len(xs)//2]:7.2f} mean={st.mean(xs):7.2f} p90={xs[len(xs)*9//10]:7.2f} ms")
core = {}
for r in rows:
    if r.get("who") == "core": core.setdefault(r["key"], {}).update(r)
seg = {k: [] for k in ["router arrived->body", "body->parsed", "parsed->_Call.run", "_Call.run->call", "fe submitted->core recv", "core recv->core send", "core send->fe out", "core send->fe recv", "fe recv->fe out", "call->engine data", "engine data->ASGI", "router arrived->call", "call->engine ASGI", "call->head", "engine ingress", "submitted->out (core+link)",
                       "core first output", "out->router chunk", "chunk->token", "router total"]}
for r in rt:
    f = fe.get(r["rid"])
    seg["router arrived->call"].append(r["call"] - r["arrived"])
    seg["router arrived->body"].append(r["body"] - r["arrived"]); seg["body->parsed"].append(r["parsed"] - r["body"])
    seg["parsed->_Call.run"].append(r["run"] - r["parsed"]); seg["_Call.run->call"].append(r["call"] - r["run"])
    seg["call->head"].append(r["head"] - r["call"])
    seg["chunk->token"].append(r["token"] - r["chunk"])
    seg["router total"].append(r["token"] - r["arrived"])
    if f and f["arrived"]:
        seg["call->engine ASGI"].append(f["arrived"] - r["call"])
        if f.get("t_data"): seg["call->engine data"].append(f["t_data"] - r["call"]); seg["engine data->ASGI"].append(f["arrived"] - f["t_data"])
        seg["engine ingress"].append(f["submitted"] - f["arrived"])
        seg["submitted->out (core+link)"].append(f["out"] - f["submitted"])
        seg["out->router chunk"].append(r["chunk"] - f["out"])
        if f["timing"]: seg["core first output"].append(f["timing"][1])
if True:
    for f in fe.values():
        c = core.get(f["keys"][0], {})
        if "recv" in c and "sent" in c:
            seg["fe submitted->core recv"].append(c["recv"] - f["submitted"]); seg["core recv->core send"].append(c["sent"] - c["recv"]); seg["core send->fe out"].append(f["out"] - c["sent"])
            if "fe_recv" in c: seg["core send->fe recv"].append(c["fe_recv"] - c["sent"]); seg["fe recv->fe out"].append(f["out"] - c["fe_recv"])
        if rt: continue
        seg["engine ingress"].append(f["submitted"] - f["arrived"]); seg["submitted->out (core+link)"].append(f["out"] - f["submitted"])
        if f["timing"]: seg["core first output"].append(f["timing"][1])
for k, v in seg.items(): show(k, v)
for who in ("router", "frontend"):
    lag = [r for r in rows if r.get("who") == who and r.get("kind") == "lag"]
    if lag:
        print(f"loop lag {who:9} windows={len(lag)} median p50={st.median(r['p50'] for r in lag)*1e3:.2f} p90={st.median(r['p90'] for r in lag)*1e3:.2f} p99={st.median(r['p99'] for r in lag)*1e3:.2f} max={max(r['max'] for r in lag)*1e3:.1f} ms")
    for r in lag: print(f"  {who}: busy {r['busy_frac']*100:.0f}% iters {r['iters']} it p50 {r['it_p50']*1e3:.2f} p90 {r['it_p90']*1e3:.2f} p99 {r['it_p99']*1e3:.2f} max {r['it_max']*1e3:.1f} ms gc(n,total s,max s) {r['gc']}")
print("router connects:", sum(1 for r in rows if r.get("kind") == "connect"))
