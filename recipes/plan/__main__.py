import sys

from recipes.plan.cli import main

sys.exit(main())
