import sys

from easy_context.programs.plan.cli import main

sys.exit(main())
