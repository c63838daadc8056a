"""The commands whose bodies draw on several packages (`train` and `finetune`: the trainer, the planner's memory
verdict and evaluation note; `export`: a run read back, adapters, Hugging Face and GGUF writers; `plan` and
`doctor`: the planner, the scaling law's fit and searches, the optimizer table). Here, above every package they
use, so no package imports one above it (plan/ <-> scaling/ was the last such circle); a command within one package
keeps its body in that package's cli.py (`prepare`: data/cli.py, `eval`: evaluation/cli.py). ``cli.py:COMMANDS``
names them all."""
