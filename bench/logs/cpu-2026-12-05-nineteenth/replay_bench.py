# Run from the repository root with TOKENIZERS_PARALLELISM=false; /tmp/mtiny: `python -m engines.make_model /tmp/mtiny --preset tiny`.
import random, statistics, sys, time, glob
from engines.tokenizer import Tokenizer
from engines.sequence import Sequence
from engines.sampling import SamplingParams
tok = Tokenizer("/tmp/mtiny")
rng = random.Random(0)
words = open("engines/data/corpus.txt", errors="ignore").read().split()
def text_ids():
    return tok.encode(" ".join(rng.choice(words) for _ in range(700)), add_special_tokens=False)[:900]
cases = {"text": [text_ids() for _ in range(256)],
         "random": [[rng.randrange(tok.vocab_size) for _ in range(900)] for _ in range(256)]}
p = SamplingParams(temperature=0.0, max_tokens=4096, seed=1)
for name, streams in cases.items():
    def run():
        t = time.perf_counter()
        for ids in streams:
            Sequence(ids, p, tok, set(), 8192, lambda o: None, None, replayed=300)
        return (time.perf_counter() - t) * 1e3
    print(f"{name}: 256 Sequences, median of 15: {statistics.median([run() for _ in range(15)]):.2f} ms")
