"""The commands whose bodies draw on several packages (`train` and `finetune`: the trainer, the planner's memory
verdict and evaluation note; `export`: a run read back, adapters, Hugging Face and GGUF writers). Here, above every
package they use, so no package imports one above it; a command within one package keeps its body in that
package's cli.py (`prepare`: data/cli.py, `plan`: plan/cli.py, `eval`: evaluation/cli.py). ``cli.py:COMMANDS``
names them all."""
