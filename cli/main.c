/* cli/main.c: cohortctl, the command line. Dispatches to one function per
 * subcommand; each lives in its own file under cli/. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "base/opt.h"

static const char usage[] =
    "Usage: cohortctl COMMAND [options]\n"
    "\n"
    "Commands:\n"
    "  run         run a local cohort: a broker, sidecars and trainers\n"
    "  status      show cohorts, epochs, leaders and members from a broker\n"
    "  bench       run a benchmark (see 'cohortctl bench --help')\n"
    "  help        show this text\n"
    "\n"
    "Run 'cohortctl COMMAND --help' for a command's options.\n";

int main(int argc, char **argv)
{
    if (argc < 2) {
        fputs(usage, stderr);
        return OPT_EXIT_USAGE;
    }
    if (strcmp(argv[1], "run") == 0)
        return cli_run(argc - 1, argv + 1);
    if (strcmp(argv[1], "status") == 0)
        return cli_status(argc - 1, argv + 1);
    if (strcmp(argv[1], "bench") == 0)
        return cli_bench(argc - 1, argv + 1);
    if (strcmp(argv[1], "help") == 0 || strcmp(argv[1], "--help") == 0 ||
        strcmp(argv[1], "-h") == 0) {
        fputs(usage, stdout);
        return 0;
    }
    return opt_usage("cohortctl", "unknown command \"%s\"", argv[1]);
}
