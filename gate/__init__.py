"""The overfit gate (issue #48): a drafter trained to near-certainty on a few sequences must be served at near the
block size, in our harness, in the reference `dflash` package's loop and in llama.cpp. Nothing finds a train/serve
mismatch (a label offset, a context mask, a layer-id offset, a config key an engine reads otherwise) faster.

    make gate [ARGS="drafter.num_layers=2 gate.plant=labels+1"] [ENGINES=harness,reference,llamacpp]
    .venv/bin/python -m gate [hydra overrides, e.g. model=... gate.sequences=4 gate.engines=[harness]]

The gate sits above the stages: it captures with `pipeline`, trains with `trainer` and serves with `harness` (and
the reference package and llama.cpp), in this process; no stage imports it.

1. capture `gate.sequences` prompts of data.sources (the train split) with their greedy responses of
   `gate.max_new_tokens` tokens, in this process (cluster.num_actors=0), one prompt at a time, float32 by default
   (gate/stages.py);
2. train a drafter of the `drafter` settings on them alone, every anchor of every sequence in each step, until the
   training tau reaches `gate.train_tau` x block size (train.stop_tau) on `gate.stable_steps` steps in a row
   (train.stop_steps), at most `gate.max_steps` steps; the trainer exports it in the published format;
3. serve those prompts greedily from that folder in each engine of `gate.engines` (gate/engines.py): `harness` (our
   loop, harness/speculative.py), `reference` (`dflash.model.dflash_generate` with the package's own drafter class)
   and `llamacpp` (the folder and the target converted to f32 GGUF by llama.cpp's own converter into
   `gate.out_dir`/gguf, each prompt's tokens as text through `llama-speculative-simple --spec-type draft-dflash`,
   greedy; its rounds, drafts and committed tokens read from its debug log, harness/llamacpp.py). `llamacpp` needs a
   cached build (`make llamacpp`): the gate does not build one and refuses the engine by name without it. Each engine
   must commit at least `gate.threshold` x block size tokens a round (its tau). llama.cpp's first round drafts from
   the prompt's last token and commits the first generated token (the others take it from the prefill): one round
   more a prompt; its rounds are cut at the gate's token budget as the harness's loop cuts its own.

It prints the training figures, tau per engine and, for an engine that falls short, the first round that did: the
sequence, the round, its positions, the drafted tokens against the committed ones (gate/verdict.py). With harness and
llamacpp both served it sets their rounds against each other one by one (gate/parity.py; aligned by the output
position of a round's first committed token, on the stretch both outputs agree: `harness.llamacpp.round_parity`) and
prints the count of aligned rounds, of those committing the same count and of those drafting the same tokens, with
the first few that differ; then again with llama.cpp serving each prompt with the harness's first generated token
appended, so that its rounds are anchored where ours are (`anchored_llamacpp`; as served, a near-certain drafter's
llama.cpp rounds start one token before ours throughout: docs/serving.md, "llama.cpp's rounds against ours").
Exit 0: passed; 1: failed; 2: refused (an engine or a setting it cannot run). `gate.plant` puts a known mismatch in,
to see it fail (gate/plants.py): labels+1 trains each block position on the token after its own; layers-1 serves the
drafter with every target layer id one lower than it was trained on (the embedded default still passes that one:
docs/serving.md). Everything goes to `gate.out_dir`, the report to gate.json. The gate checks the target first (its
config readable, data.max_length within its positions), then writes only into a folder it owns (gate/folder.py): a
new or empty one, which it marks as its own (`.flashdraft-gate`), or one it marked before, which it clears; any other
folder is refused by name, untouched.
"""
