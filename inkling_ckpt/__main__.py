from .cli.app import console

console()
