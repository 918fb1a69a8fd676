"""``python -m fsg.data prepare IN.txt OUT.bin [--tokenizer tiktoken:gpt2|bytes]``."""

import sys

from fsg._src.data._prepare import main

sys.exit(main())
