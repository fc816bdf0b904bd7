#!/usr/bin/env python
"""Print the model-type tables of docs/model_types.md from easy_context/hf/architectures.py (one list).

python -m tools.model_types_table
"""

from easy_context.hf.architectures import markdown_tables

if __name__ == "__main__":
    print(markdown_tables())
