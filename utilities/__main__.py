import sys

from utilities.course.cli import main

sys.exit(main())
