/* cli/cli.h: cohortctl's subcommands. Each takes argv from the subcommand
 * name on and returns the process exit status: 0 success, 1 failure, 2
 * usage error. */
#ifndef COHORT_CLI_H
#define COHORT_CLI_H

int cli_status(int argc, char **argv);
int cli_run(int argc, char **argv);              /* argv[0] is "run" */
int cli_bench(int argc, char **argv);
int cli_bench_allreduce(int argc, char **argv);   /* argv[0] is "allreduce" */
int cli_bench_accumulator(int argc, char **argv); /* argv[0] is "accumulator" */
int cli_bench_checkpoint(int argc, char **argv);  /* argv[0] is "checkpoint" */

#endif
