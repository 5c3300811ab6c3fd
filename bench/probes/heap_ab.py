"""The heap test's child (tests/test_shared_kv_units.py, the heap test) run with or without
engines/heap.py keep_freed_memory(): blocks adopted, page faults in the claim, in its sort.

    python bench/probes/heap_ab.py with|without
"""
import sys, textwrap
src = open('tests/test_shared_kv_units.py').read()
child = src[src.index('child = textwrap.dedent("""', src.index('def test_with_the_heap'))+len('child = textwrap.dedent("""'):]
child = textwrap.dedent(child[:child.index('""")')])
if sys.argv[1] == "without":
    child = child.replace("assert keep_freed_memory()", "pass")
exec(compile(child, "child", "exec"))
