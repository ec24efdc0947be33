"""``python -m hybrid plan`` (being written)."""


def add_parser(sub):
    return sub.add_parser("plan", help="print the bucket plan and ZeRO view of a model")


def run(args) -> int:
    raise NotImplementedError
