"""``hybrid.demo._rank_server``'s loop without its imports, for tests of the protocol alone
(``python -m tests.demo._bare_rank_server FD``): it starts in a tenth of the time."""

import sys

from hybrid.demo._rank_server import serve

if __name__ == "__main__":
    serve(int(sys.argv[1]))
