/* tests/unit/test_keys.c: a cohort's Secret: the object the operator makes
 * (owned by the cohort, labelled, the key as 64 hex digits, the CA), what
 * it adopts and what it refuses without touching (someone else's Secret,
 * a key that does not parse), the CA patch, and the key id pods carry. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k8s/keys.h"
#include "k8s/kube.h"

static cJSON *parse(const char *json)
{
    cJSON *o = cJSON_Parse(json);
    cr_assert_not_null(o, "bad test JSON: %s", json);
    return o;
}

static cJSON *cohort(void)
{
    return parse("{\"apiVersion\":\"cohort.dev/v1alpha1\",\"kind\":\"TrainingCohort\","
                 "\"metadata\":{\"name\":\"lr\",\"namespace\":\"ns\",\"uid\":\"u-1\"},"
                 "\"spec\":{}}");
}

static struct secret key_of(uint8_t fill)
{
    struct secret k;
    memset(k.key, fill, sizeof(k.key));
    return k;
}

static const char *sget(const cJSON *o, const char *a, const char *b)
{
    const cJSON *v = cJSON_GetObjectItem(b ? cJSON_GetObjectItem(o, a) : o, b ? b : a);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* data[k] of a Secret, decoded; the caller frees it. */
static char *data_of(const cJSON *sec, const char *k)
{
    char *out = NULL;
    cr_assert_eq(kube_secret_data(sec, k, &out, NULL), 0, "no data[%s]", k);
    return out;
}

Test(keys, secret_is_owned_labelled_and_holds_the_key_and_the_ca)
{
    cJSON *tc = cohort(), *sec = NULL;
    struct secret k = key_of(0xab);
    const cJSON *owner;
    char *text;

    cr_assert_eq(keys_secret(tc, &k, "-----BEGIN CERTIFICATE-----\nX\n", &sec), 0);
    cr_assert_str_eq(sget(sec, "metadata", "name"), "lr-cohort-key");
    cr_assert_str_eq(sget(sec, "metadata", "namespace"), "ns");
    cr_assert_str_eq(sget(sec, "type", NULL), "Opaque");
    cr_assert_str_eq(sget(cJSON_GetObjectItem(sec, "metadata"), "labels", "cohort.dev/cohort"),
                     "lr");
    owner = cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetObjectItem(sec, "metadata"),
                                                   "ownerReferences"), 0);
    cr_assert_str_eq(sget(owner, "uid", NULL), "u-1");
    cr_assert_str_eq(sget(owner, "kind", NULL), "TrainingCohort");
    cr_assert_str_eq(sget(owner, "apiVersion", NULL), "cohort.dev/v1alpha1");
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(owner, "controller")));
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(owner, "blockOwnerDeletion")));
    text = data_of(sec, "key");
    cr_assert_eq(strlen(text), 64);
    cr_assert_eq(strspn(text, "0123456789abcdef"), 64);
    cr_assert_str_eq(text, "abababababababababababababababababababababababababababababababab");
    free(text);
    text = data_of(sec, "ca.crt");
    cr_assert_str_eq(text, "-----BEGIN CERTIFICATE-----\nX\n");
    free(text);
    cJSON_Delete(sec);
    /* Without TLS there is no ca.crt. */
    cr_assert_eq(keys_secret(tc, &k, NULL, &sec), 0);
    cr_assert_null(cJSON_GetObjectItem(cJSON_GetObjectItem(sec, "data"), "ca.crt"));
    cJSON_Delete(sec);
    cJSON_Delete(tc);
}

Test(keys, secret_needs_a_whole_cohort)
{
    cJSON *tc = parse("{\"metadata\":{\"name\":\"lr\",\"namespace\":\"ns\"}}"), *sec = NULL;
    struct secret k = key_of(1);

    cr_assert_eq(keys_secret(tc, &k, NULL, &sec), -EINVAL, "no uid");
    cr_assert_null(sec);
    cJSON_Delete(tc);
}

Test(keys, adopts_its_own_secret_and_reads_the_key_back)
{
    cJSON *tc = cohort(), *sec = NULL;
    struct secret k = key_of(0x5a), got = { 0 };
    struct reconcile_why why;

    cr_assert_eq(keys_secret(tc, &k, NULL, &sec), 0);
    cr_assert_eq(keys_adopt(tc, sec, &got, &why), 0, "%s", why.message);
    cr_assert_arr_eq(got.key, k.key, sizeof(k.key));
    cJSON_Delete(sec);
    /* A Secret the user made with an owner reference to the cohort, and
     * a key of their own, with a newline: theirs to give. */
    sec = parse("{\"metadata\":{\"name\":\"lr-cohort-key\",\"ownerReferences\":[{\"kind\":"
                "\"TrainingCohort\",\"name\":\"lr\",\"uid\":\"u-1\"}]},\"data\":{\"key\":"
                "\"MDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMQo=\"}}");
    cr_assert_eq(keys_adopt(tc, sec, &got, &why), 0, "%s", why.message);
    cr_assert_eq(got.key[31], 1);
    cr_assert_eq(got.key[0], 0);
    cJSON_Delete(sec);
    cJSON_Delete(tc);
}

static void refused(const char *secret_json, const char *reason)
{
    cJSON *tc = cohort(), *sec = parse(secret_json);
    struct secret got = { 0 };
    struct reconcile_why why;

    cr_assert_eq(keys_adopt(tc, sec, &got, &why), -EINVAL, "%s adopted", secret_json);
    cr_assert_str_eq(why.reason, reason, "%s", secret_json);
    cr_assert(strstr(why.message, "ns/lr-cohort-key"), "%s", why.message);
    cJSON_Delete(sec);
    cJSON_Delete(tc);
}

Test(keys, refuses_someone_elses_secret_and_a_bad_key)
{
    /* No owner, another owner's uid, another kind with the same uid. */
    refused("{\"metadata\":{\"name\":\"lr-cohort-key\"},\"data\":{\"key\":\"YWJj\"}}",
            "SecretConflict");
    refused("{\"metadata\":{\"name\":\"lr-cohort-key\",\"ownerReferences\":[{\"kind\":"
            "\"TrainingCohort\",\"uid\":\"u-0\"}]}}", "SecretConflict");
    refused("{\"metadata\":{\"name\":\"lr-cohort-key\",\"ownerReferences\":[{\"kind\":"
            "\"Deployment\",\"uid\":\"u-1\"}]}}", "SecretConflict");
    /* Ours, but no key, a short one, not base64, not a string. */
#define OURS "{\"metadata\":{\"name\":\"lr-cohort-key\",\"ownerReferences\":[{\"kind\":" \
             "\"TrainingCohort\",\"uid\":\"u-1\"}]}"
    refused(OURS "}", "SecretInvalid");
    refused(OURS ",\"data\":{\"key\":\"YWJj\"}}", "SecretInvalid");
    refused(OURS ",\"data\":{\"key\":\"!!!\"}}", "SecretInvalid");
    refused(OURS ",\"data\":{\"key\":7}}", "SecretInvalid");
#undef OURS
}

Test(keys, ca_patch_only_when_the_ca_differs)
{
    cJSON *tc = cohort(), *sec = NULL, *patch = NULL;
    struct secret k = key_of(3);
    char *text;

    cr_assert_eq(keys_secret(tc, &k, "CA-1", &sec), 0);
    cr_assert_eq(keys_ca_patch(sec, "CA-1", &patch), 0);
    cr_assert_null(patch, "the same CA: nothing to do");
    cr_assert_eq(keys_ca_patch(sec, "CA-2", &patch), 0);
    cr_assert_not_null(patch);
    text = data_of(patch, "ca.crt");
    cr_assert_str_eq(text, "CA-2");
    free(text);
    cr_assert_null(cJSON_GetObjectItem(cJSON_GetObjectItem(patch, "data"), "key"),
                   "the key is never in a patch");
    cJSON_Delete(patch);
    /* TLS turned off: the CA goes (a merge patch null). */
    cr_assert_eq(keys_ca_patch(sec, NULL, &patch), 0);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(cJSON_GetObjectItem(patch, "data"), "ca.crt")));
    cJSON_Delete(patch);
    cJSON_Delete(sec);
    cr_assert_eq(keys_secret(tc, &k, NULL, &sec), 0);
    cr_assert_eq(keys_ca_patch(sec, NULL, &patch), 0);
    cr_assert_null(patch);
    cr_assert_eq(keys_ca_patch(sec, "CA-1", &patch), 0);
    cr_assert_not_null(patch);
    cJSON_Delete(patch);
    cJSON_Delete(sec);
    cJSON_Delete(tc);
}

Test(keys, id_follows_the_key_and_the_ca_and_hides_the_key)
{
    struct secret a = key_of(1), b = key_of(2);
    char ida[KEYS_ID_CHARS + 1], ida2[KEYS_ID_CHARS + 1], idb[KEYS_ID_CHARS + 1];
    char idc[KEYS_ID_CHARS + 1], hex[SECRET_HEX_CHARS + 1];

    cr_assert_eq(keys_id(&a, "CA", ida), 0);
    cr_assert_eq(keys_id(&a, "CA", ida2), 0);
    cr_assert_eq(keys_id(&b, "CA", idb), 0);
    cr_assert_eq(keys_id(&a, NULL, idc), 0);
    cr_assert_eq(strlen(ida), KEYS_ID_CHARS);
    cr_assert_str_eq(ida, ida2);
    cr_assert_str_neq(ida, idb);
    cr_assert_str_neq(ida, idc);
    secret_format(&a, hex);
    cr_assert_null(strstr(hex, ida));
}
